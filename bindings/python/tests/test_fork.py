"""A forked process gets its own copy of a loaded buffer, as of any other
Python object, and a buffer's memfd is handed out only while it holds the
bytes the buffer shows."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dmaload

from conftest import write_random

SIZE = 3 << 20  # several pages, and more than one huge page's worth


def _line(fd: int) -> bytes:
    """One line from a pipe: the other process's marker (no sleeping)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


def _fork_and_run(child: Any) -> tuple[int, int, int]:
    """Forks; the child runs `child(to_parent, from_parent)` and exits with
    its return value. Returns (pid, from_child, to_child)."""
    child_r, parent_w = os.pipe()
    parent_r, child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(parent_w)
            os.close(parent_r)
            code = child(child_w, child_r)
        finally:
            os._exit(code)
    os.close(child_r)
    os.close(child_w)
    return pid, parent_r, parent_w


def _exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("to", ["auto", "memfd"])
def test_a_forked_child_and_its_parent_each_write_their_own_copy(tmp_path: Path, to: str) -> None:
    """Both directions, with numpy and torch views made before the fork:
    the child's in-place writes never reach the parent, the parent's
    writes after the fork never reach the child, and each process's views
    keep showing its own bytes."""
    path = tmp_path / "f.bin"
    data = write_random(path, SIZE)
    buf = dmaload.load(path, to=to)
    array = np.frombuffer(buf, dtype=np.uint8)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)

    def child(to_parent: int, from_parent: int) -> int:
        array[:] = 0xAA  # every page, through numpy
        tensor[0] = 0x55  # and one through torch
        os.write(to_parent, b"WROTE\n")
        assert _line(from_parent) == b"PARENT WROTE\n"
        # The parent's writes since the fork did not reach this copy.
        mine = bytes(memoryview(buf))
        ok = mine[0] == 0x55 and mine[1:] == b"\xaa" * (SIZE - 1) and tensor[1].item() == 0xAA
        return 0 if ok else 7

    pid, from_child, to_child = _fork_and_run(child)
    assert _line(from_child) == b"WROTE\n"
    # The child's writes did not reach the parent.
    assert bytes(memoryview(buf)) == data
    assert array.tobytes() == data and bytes(tensor.numpy()) == data
    array[:] = 0x11
    os.write(to_child, b"PARENT WROTE\n")
    assert _exit_code(pid) == 0, "the child saw the parent's writes made after the fork"
    assert bytes(memoryview(buf)) == b"\x11" * SIZE and tensor[-1].item() == 0x11


def _child_writes(buf: Any, wrote: Any, parent_wrote: Any, expected: bytes, result: Any) -> None:
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:] = 0xCC
    wrote.set()
    parent_wrote.wait()
    result.value = int(view.tobytes() == expected)


def test_multiprocessing_fork_workers_get_their_own_copy(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = write_random(path, SIZE)
    buf = dmaload.load(path)
    ctx = multiprocessing.get_context("fork")
    wrote, parent_wrote = ctx.Event(), ctx.Event()
    result = ctx.Value("i", -1)
    worker = ctx.Process(target=_child_writes, args=(buf, wrote, parent_wrote, b"\xcc" * SIZE, result))
    worker.start()
    assert wrote.wait(60)
    assert bytes(memoryview(buf)) == data, "a fork worker's writes reached the parent"
    np.frombuffer(buf, dtype=np.uint8)[:] = 0x22
    parent_wrote.set()
    worker.join(60)
    assert worker.exitcode == 0 and result.value == 1, "the worker saw the parent's writes"


def test_a_memfd_that_no_longer_holds_the_buffer_bytes_is_not_handed_out(tmp_path: Path) -> None:
    """After a fork the buffer is private: untouched, its memfd still holds
    its bytes and is handed out; written in place, fileno(), dup_memfd()
    and send() refuse rather than give others bytes it does not show."""
    path = tmp_path / "f.bin"
    data = write_random(path, SIZE)
    buf = dmaload.load(path)
    pid, from_child, _ = _fork_and_run(lambda to_parent, _: 0)
    assert _exit_code(pid) == 0
    fd = buf.dup_memfd()
    try:
        assert os.pread(fd, SIZE, buf.memfd_offset) == data
    finally:
        os.close(fd)
    np.frombuffer(buf, dtype=np.uint8)[5] ^= 0xFF
    with pytest.raises(OSError, match="no longer holds the bytes"):
        buf.dup_memfd()
    with pytest.raises(OSError, match="no longer holds the bytes"):
        buf.fileno()
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right, pytest.raises(OSError, match="no longer holds the bytes"):
        buf.send(left)


def test_a_buffer_sent_then_written_is_not_sent_again_stale(tmp_path: Path) -> None:
    """send() gives the receiver the bytes the buffer shows; written since,
    a second send is refused, and a received buffer written in place is
    not passed on with its sender's bytes."""
    path = tmp_path / "f.bin"
    data = write_random(path, SIZE)
    buf = dmaload.load(path)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        buf.send(left)
        got = dmaload.Buffer.receive(right)
        assert bytes(memoryview(got)) == data
        np.frombuffer(buf, dtype=np.uint8)[0] ^= 0xFF
        with pytest.raises(OSError, match="no longer holds the bytes"):
            buf.send(left)
        np.frombuffer(got, dtype=np.uint8)[1] ^= 0xFF
        with pytest.raises(OSError, match="no longer holds the bytes"):
            got.send(right)


def test_a_child_forked_while_another_thread_loads_gets_none_of_that_load(tmp_path: Path) -> None:
    """Issue 34: a fork while a load was in flight on another thread left the
    child sharing the buffer's memory (dup_memfd then failed EBUSY while
    the child lived, and the child kept the memory after the parent closed
    the buffer). A load in flight at a fork is left out of the child: no
    mapping of its memfd and no descriptor of it there; the parent's load
    completes and its buffer shares as any other."""
    path = tmp_path / "f.bin"
    data = write_random(path, 4 * SIZE)
    started, release = threading.Event(), threading.Event()

    def progress(done: int, total: int) -> None:
        # Holds the load in flight (its buffer not yet made) until the fork is done.
        if not started.is_set():
            started.set()
            release.wait(60)

    loaded: list[dmaload.Buffer] = []
    loader = threading.Thread(target=lambda: loaded.append(dmaload.load(path, to="memfd", progress=progress)))
    loader.start()
    assert started.wait(60), "no progress reported"
    child_r, parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(child_r, 1)  # stays until the parent has looked at it
        os._exit(0)
    os.close(child_r)
    try:
        release.set()
        loader.join(60)
        (buf,) = loaded
        assert bytes(memoryview(buf)) == data
        fd = buf.dup_memfd()  # EBUSY while a child shares a writable mapping
        try:
            memfd = os.fstat(fd).st_ino
            assert os.pread(fd, 4 * SIZE, buf.memfd_offset) == data
        finally:
            os.close(fd)
        mapped = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if line.split()[4] == str(memfd)]
        assert not mapped, f"the child maps the load's memfd: {mapped}"
        held = []
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.stat(f"/proc/{pid}/fd/{name}").st_ino == memfd:
                    held.append(os.readlink(f"/proc/{pid}/fd/{name}"))
            except FileNotFoundError:
                pass
        assert not held, f"the child holds the load's memfd: {held}"
    finally:
        os.write(parent_w, b"x")
        os.close(parent_w)
        assert _exit_code(pid) == 0
